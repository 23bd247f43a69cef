"""`cachelane`'s commands."""
