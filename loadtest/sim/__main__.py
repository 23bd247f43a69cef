import sys

from loadtest.sim.fleet import main

sys.exit(main(sys.argv[1:]))
