import sys

from specq.worker.bench import main

sys.exit(main())
