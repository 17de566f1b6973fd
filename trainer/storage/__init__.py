"""Where things live: local folders, shared filesystems and S3 behind one addressing
function, with transient errors retried."""
