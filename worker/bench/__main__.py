import sys

from worker.bench import main

sys.exit(main())
