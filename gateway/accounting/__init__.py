"""What offloading costs and what the gateway learns: ledgers, capture, findings, fits."""
