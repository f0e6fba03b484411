"""PySpark glue: the only package that imports pyspark.

It is empty for now: the partition hooks, the Structured Streaming operator, preferred
locations and ``read_state`` arrive with the PySpark glue issue, on top of the store and
the coordinators.
"""
