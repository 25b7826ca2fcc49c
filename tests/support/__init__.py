"""What the tests share: meshes and random inputs (helpers), the NumPy oracle, gradient problems (grads), program
shapes, and the worker scripts that multi-process tests start (mp_worker, mp_failure_worker, shm_leak_worker,
fabric_worker) through multiprocess.launch / fabric_mp.run_world. tests/conftest.py puts tests/ on sys.path."""
