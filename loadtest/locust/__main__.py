import sys

from loadtest.locust.run import main

sys.exit(main(sys.argv[1:]))
