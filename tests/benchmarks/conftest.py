"""The benchmark smoke tests share the Ray instance of the Ray test suite."""

from tests.ray.conftest import ray_session  # noqa: F401
