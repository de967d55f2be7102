"""The versioned weight store between trainer and generators: docs/weight_store.md.

index.py       which versions exist, are complete, and who holds them (plain Python)
layout.py      one snapshot = one safetensors file, planned before it is written
shm.py         same-host transport: /dev/shm files, recycled, mapped once per process
actors.py      StoreIndexActor and StorageVolumeActor (Monarch), open_store / find_index
client.py      WeightStore: torchstore's interface, leases, shm or RDMABuffer reads
publisher.py   the trainer's background publishing
loader.py      the generator's update: wait, lease, prefetch, stage, swap
vllm_staging.py  vLLM worker extension: stage a version beside the served one, swap references
"""
