"""The process room: running a job in this process or on fresh torchrun ranks (`jobs`, `launch`)
and results travelling back from rank 0 without pickle (`result_io`)."""
