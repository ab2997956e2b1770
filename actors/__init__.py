"""Ray actors, the Ray executor, the Serve app and the batch-job entry (they build on `writescope`)."""
