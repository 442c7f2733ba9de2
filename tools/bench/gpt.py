# The GPT decoder moved to shard_cli.gpt (shard train and shard plan use it); re-exported here.
from shard_cli.gpt import *  # noqa: F403
