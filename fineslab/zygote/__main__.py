import sys

from fineslab.zygote.server import main

sys.exit(main())
