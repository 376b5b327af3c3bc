"""Engine core: requests, the paged KV cache with prefix caching, and the scheduler."""
