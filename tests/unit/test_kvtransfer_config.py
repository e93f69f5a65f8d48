"""kvtransfer: role configs, UCX env, the handoff's msgpack round trip and its byte accounting."""

from __future__ import annotations

from kvtransfer.config import TransferConfig, free_port, kv_transfer_kwargs, transfer_env
from kvtransfer.handoff import KVHandoff


def _handoff(**kw) -> KVHandoff:
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 7, 9]],
              "remote_engine_id": "prefill-0-abc", "remote_request_id": "r1", "remote_host": "127.0.0.1",
              "remote_port": 5601, "remote_prefill_cached_tokens": 0, "tp_size": 1}
    return KVHandoff(request_id="r1", prefill_worker="prefill-0", prefill_engine_id="prefill-0-abc",
                     prompt_tokens=300, kv_transfer_params=params, block_bytes=1 << 20, block_size=128, **kw)


def test_roles_and_devices():
    cfg = TransferConfig(failure_policy="fail", kv_lease_s=12)
    p = kv_transfer_kwargs("prefill", "e1", "cpu", cfg)
    d = kv_transfer_kwargs("decode", "e2", "cuda", cfg)
    assert (p["kv_role"], p["kv_buffer_device"]) == ("kv_producer", "cpu")
    assert (d["kv_role"], d["kv_buffer_device"]) == ("kv_consumer", "cuda")
    assert p["kv_load_failure_policy"] == "fail"
    extra = p["kv_connector_extra_config"]
    assert extra["kv_lease_duration"] == 12 and extra["kv_recompute_threshold"] == 0


def test_env_loopback_vs_cluster():
    cfg = TransferConfig()
    lo = transfer_env(cfg, 5601, "cpu", "127.0.0.1")
    assert lo["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1" and lo["UCX_NET_DEVICES"] == "lo"
    node = transfer_env(cfg, 5601, "cuda", "198.51.100.3")
    assert node["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "198.51.100.3" and "UCX_NET_DEVICES" not in node
    tuned = transfer_env(TransferConfig(ucx_tls="tcp", ucx_net_devices="eth0"), 1, "cpu", "198.51.100.3")
    assert tuned["UCX_TLS"] == "tcp" and tuned["UCX_NET_DEVICES"] == "eth0"


def test_free_ports_differ_while_held():
    import socket

    a = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", a))
        b = free_port()
    assert a != b


def test_handoff_msgpack_round_trip_and_bytes():
    h = _handoff(first_token_id=42, prefill_s=0.25, created_at=1.5)
    back = KVHandoff.from_bytes(h.to_bytes())
    assert back == h
    assert back.num_blocks == 3 and back.kv_bytes == 3 << 20
    assert "remote_prefill_cached_tokens" not in back.decode_params()
    assert back.decode_params()["remote_block_ids"] == [[3, 7, 9]]


def test_handoff_flat_block_list():
    h = _handoff()
    h.kv_transfer_params["remote_block_ids"] = [1, 2]
    assert h.num_blocks == 2


def test_free_ports_come_from_below_the_ephemeral_range(tmp_path) -> None:
    import socket

    from kvtransfer import config

    ports = {config.free_port("127.0.0.1") for _ in range(20)}
    low = config._ephemeral_low()
    assert all(1024 <= p < low for p in ports) and len(ports) > 1
    for p in ports:  # each was free when chosen
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert config._ephemeral_low(str(f)) == 40000
    assert config._ephemeral_low(str(tmp_path / "missing")) == 32768


def test_free_port_falls_back_to_any_free_port_when_the_ephemeral_range_leaves_none_below(monkeypatch) -> None:
    import socket

    from kvtransfer import config

    monkeypatch.setattr(config, "_ephemeral_low", lambda *a: 1024)
    p = config.free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))
