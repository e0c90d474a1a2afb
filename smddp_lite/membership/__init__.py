"""Who is in a surviving job: the store's keys (job_store.py), each member's heartbeat
(heartbeat.py, beaten by beating.py's process), one compare-and-set per generation for losses
and admissions alike (generations.py), and the errors that end a rank's part (errors.py)."""
