"""Reports over finished runs: what the demo measured and the summary it prints."""
