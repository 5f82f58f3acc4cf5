"""lmdq as a Python library: :class:`lmdq.Client`, its submit options and the sources it accepts."""
