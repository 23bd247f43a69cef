"""A request's path: plan (the pipeline's adapter), flow control, proxy, settlement."""
