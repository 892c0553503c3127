"""The offloader's config validates its own fields."""

import pytest

from gdskv.config import MiB
from gdskv.errors import ConfigError
from gdskv.offload_config import OffloaderConfig


@pytest.mark.parametrize(
    "field, bad",
    [
        ("policy", "lazy"),
        ("high_watermark", "0.9"),
        ("low_watermark", float("nan")),
        ("bucket_bytes", 0),
        ("bucket_bytes", "lots"),
        ("bucket_max_keys", 0),
        ("bucket_max_keys", 2.5),
        ("bucket_max_age_s", 0),
        ("bucket_max_age_s", float("inf")),
        ("bucket_max_age_s", 400 * 24 * 3600.0),
        ("offload_retry_s", -1),
        ("offload_retry_s", None),
    ],
)
def test_a_bad_field_is_refused_naming_it(field, bad):
    with pytest.raises(ConfigError) as info:
        OffloaderConfig(**{field: bad})
    assert info.value.context["field"] == field


@pytest.mark.parametrize("low, high", [(0.95, 0.9), (0.0, 0.5), (0.5, 1.5)])
def test_watermarks_must_satisfy_low_le_high(low, high):
    with pytest.raises(ConfigError, match="0 < low <= high <= 1"):
        OffloaderConfig(low_watermark=low, high_watermark=high)


def test_valid_settings_and_sizes():
    cfg = OffloaderConfig(policy="watermark", low_watermark=0.5, high_watermark=0.5, bucket_bytes="2MiB", offload_retry_s=0)
    assert cfg.bucket_bytes == 2 * MiB and cfg.policy == "watermark"
