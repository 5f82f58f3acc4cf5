"""Workers as the queue sees them: the worker roster, the models they serve, cancellations."""
