"""What-if planning: replay a traffic capture through a cache model and the cost model under
alternative set-ups (`cachelane plan`). Pure: no IO; the CLI (gateway/cli/plan.py) reads the file
and prints."""
