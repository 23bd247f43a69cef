"""`cachelane demo`: routing policies compared on a simulated fleet, then the tier decisions."""
