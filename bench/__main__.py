import sys

from specq.bench import main

sys.exit(main())
