"""Load generation and the simulated GPU fleet used to demo and measure cachelane."""
