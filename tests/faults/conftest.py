"""The moto S3 server of the engine tests, for the S3 rows of the fault matrix."""

from tests.engine.conftest import s3_bucket, s3_env, s3_server  # noqa: F401
