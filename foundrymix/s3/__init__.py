"""Every S3 touch: one client factory and error vocabulary, the bounded download, retry counting."""
