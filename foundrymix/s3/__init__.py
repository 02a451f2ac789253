"""Every S3 touch: the bounded download (one client factory, one vocabulary of error codes and hints) and retry counting."""
