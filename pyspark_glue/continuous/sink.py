from statecore.checkpoint import CheckpointFiles, EpochLog
