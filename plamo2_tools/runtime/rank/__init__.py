"""The rank room: one rank's weights, its collectives (threads of one process or torchrun ranks)
and process-group set-up.  The rank's forward itself is its family's (model/<family>/layers.py)."""
