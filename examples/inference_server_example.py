"""The MLX RL inference server's client example, as its README writes it, against rlserve.

Start a server the way that README does (`rlserve serve` in place of `python -m mlx_lm.inference_server`):

    rlserve serve --model PATH --host 127.0.0.1 --port 8000 --max-batch 5 --flush-interval-ms 10 --max-tokens 128

then run `python examples/inference_server_example.py [URL] [ADAPTER_DIR]`. Only the import line differs
from the README: rlserve's async client takes the place of its `inference_client` module.
"""

import asyncio
import sys

from rlserve.client import InferenceClient

URL = sys.argv[1] if len(sys.argv) > 1 else "http://localhost:8000"
ADAPTER = sys.argv[2] if len(sys.argv) > 2 else "/path/to/adapter"


async def main():
    async with InferenceClient(URL) as client:
        # Generate text
        result = await client.generate(
            prompt="What is reinforcement learning?", temperature=0.7, max_tokens=100, policy_version=1, step_id=100
        )
        print(f"Generated: {result['text']}")

        # Load new adapter
        adapter_result = await client.load_adapter(ADAPTER)
        print(f"New policy version: {adapter_result['policy_version']}")


asyncio.run(main())
