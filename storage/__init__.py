"""Where bytes are stored, below everything that stores them: the `BlobStore` protocol (`store`), local disk
(`local`) and S3-compatible object stores (`s3`). The registry keeps its blobs here and the pipeline its stage
outputs and remote sources; neither reaches into the other for them."""
