import pytest

from tests.support.aws import aws_env, moto_server


@pytest.fixture(scope="module")
def aws_endpoint():
    """moto's server on loopback, with fake credentials in the environment."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in aws_env().items():
            mp.setenv(key, value)
        with moto_server() as url:
            yield url
