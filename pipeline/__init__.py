"""The build pipeline: recipe, stage graph, content-addressed cache, executors, ingest."""
