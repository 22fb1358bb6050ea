"""CRYPTD_REDIS_URL: the forms cryptd takes (one Redis, Sentinel, Cluster) and a clear
refusal, naming no password, for the ones it cannot use."""

from __future__ import annotations

import pytest

from service.auth.redis_client import RedisConfigError, parse_url


def test_one_redis_is_passed_through() -> None:
    target = parse_url("rediss://user:secret@cache:6380/2?ssl_cert_reqs=required")
    assert target.mode == "standalone"
    assert target.url == "rediss://user:secret@cache:6380/2?ssl_cert_reqs=required"
    assert parse_url("redis://cache:6379/0?cluster=false").url == "redis://cache:6379/0"
    assert parse_url("unix:///run/redis.sock").mode == "standalone"


def test_sentinel_url() -> None:
    target = parse_url(
        "redis+sentinel://cryptd:p%40ss@s1:26379,s2:26380,[::1]:26381/primary/3?sentinel_password=x"
    )
    assert target.mode == "sentinel"
    assert target.nodes == (("s1", 26379), ("s2", 26380), ("::1", 26381))
    assert target.service == "primary"
    assert target.db == 3
    assert (target.username, target.password) == ("cryptd", "p@ss")
    assert dict(target.options) == {"sentinel_password": "x"}
    assert not target.tls
    assert parse_url("rediss+sentinel://s1/primary").tls
    assert parse_url("redis+sentinel://s1/primary").nodes == (("s1", 6379),)
    assert "p@ss" not in target.describe()
    assert target.describe() == "Sentinel s1:26379,s2:26380,::1:26381 master 'primary'"


def test_cluster_url() -> None:
    target = parse_url("rediss://:pw@n1:7000,n2:7001?cluster=true&ssl_ca_certs=/ca.pem")
    assert target.mode == "cluster"
    assert target.nodes == (("n1", 7000), ("n2", 7001))
    assert target.tls
    assert target.password == "pw"
    assert dict(target.options) == {"ssl_ca_certs": "/ca.pem"}
    assert parse_url("redis://n1:7000?cluster=true").nodes == (("n1", 7000),)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://cache:6379", "must start with"),
        ("redis://a:1,b:2/0", "several hosts"),
        ("redis+sentinel://s1:26379", "master-name"),
        ("redis+sentinel://s1:26379/", "master-name"),
        ("redis+sentinel://s1:26379/m/x", "not a number"),
        ("redis+sentinel://s1:26379/m?cluster=true", "cannot be a Cluster"),
        ("redis://n1:7000/1?cluster=true", "database 0 only"),
        ("redis://n1:7000?cluster=maybe", "true or false"),
        ("redis://n1:70000?cluster=true", "not host:port"),
        ("redis://n1:7000?cluster=true&retries=3", "unknown parameter(s) retries"),
        ("redis+sentinel://:secret@s1:x/m", "not host:port"),
    ],
)
def test_bad_urls_are_refused_with_a_reason(url: str, why: str) -> None:
    with pytest.raises(RedisConfigError, match=why.replace("(", r"\(").replace(")", r"\)")) as e:
        parse_url(url)
    assert "secret" not in str(e.value)
