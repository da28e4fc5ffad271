"""What may leave the node: the environment by allow-list, free text scrubbed of every secret
the node knows and of the parts of its values."""

from __future__ import annotations

import json
import urllib.parse

import pytest

from draftline.ops import redaction

SECRET = "hf_SuperSecretTokenValue123"
PASSWORD = "pw-Kx93-very-private"
GH_PAT = "ghp_Rk2Lm9Qx7Wz4Tn8Vb3Jc6Hd1Fs5Gp0Ya7Ue"
WEBHOOK = "https://hooks.slack.com/services/T0SALVAGE/B0SALVAGE/Wh00kS3cretPathValue42"
API_URL = "https://metrics.example/ingest?project=draftline&api_key=mk-4471-private-key"


def test_redact_env_records_only_the_allow_list() -> None:
    env = {
        "HF_TOKEN": SECRET,
        "GH_PAT": GH_PAT,
        "DB_PASS": PASSWORD,
        "NOTIFY_URL": WEBHOOK,
        "METRICS_URL": API_URL,
        "PROXY": f"http://alice:{PASSWORD}@proxy.example:3128",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "NCCL_SOCKET_IFNAME": "eth0",
        "SGLANG_API_KEY": "sk-local-sglang",
        "MASTER_PORT": "29500",
        "TOKENIZERS_PARALLELISM": "false",
        "PATH": "/usr/local/bin:/usr/bin",
        "HOME": "/home/u",
    }
    assert redaction.redact_env(env) == {
        "values": {
            "CUDA_VISIBLE_DEVICES": "0,1,2,3",
            "MASTER_PORT": "29500",
            "NCCL_SOCKET_IFNAME": "eth0",
            "PATH": "/usr/local/bin:/usr/bin",
            "TOKENIZERS_PARALLELISM": "false",
        },
        "names_only": [
            "DB_PASS", "GH_PAT", "HF_TOKEN", "HOME", "METRICS_URL", "NOTIFY_URL", "PROXY",
            "SGLANG_API_KEY",
        ],
    }  # fmt: skip
    # Secret by name (GH_PAT, DB_PASS) or by value (a webhook, an api_key URL, a token):
    # every such value is scrubbed from free text; plain values are not.
    secrets = redaction.secret_values(env)
    for value in (SECRET, GH_PAT, PASSWORD, WEBHOOK, API_URL, env["PROXY"], "sk-local-sglang"):
        assert value in secrets
    for value in ("0,1,2,3", "eth0", "29500", "/home/u", env["PATH"], "draftline", "alice"):
        assert value not in secrets


def test_redact_text_scrubs_values_and_urls() -> None:
    text = f"cmd --token {SECRET} --url https://bob:{PASSWORD}@git.example/repo.git done"
    out = redaction.redact_text(text, [SECRET])
    assert out == "cmd --token *** --url https://***@git.example/repo.git done"


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        (f"POST {WEBHOOK} 200", "POST https://hooks.slack.com/*** 200"),
        (
            "POST https://discord.com/api/webhooks/1234/AbCdEf-secret 204",
            "POST https://discord.com/api/webhooks/*** 204",
        ),
        (
            f"GET {API_URL} 200",
            "GET https://metrics.example/ingest?project=draftline&api_key=*** 200",
        ),
        (
            "GET https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F&X-Amz-Signature=9f8e7d&n=1",
            "GET https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&n=1",
        ),
        ("blob?sv=2024&sig=AbC%2Bdef&se=1", "blob?sv=2024&sig=***&se=1"),
        (
            "aws_secret_access_key = Tq9vR2mXw7LkP4sZ8nB1cF6hJ3dG5yU0aEiOQe/x",
            "aws_secret_access_key = ***",
        ),
        ("found Tq9vR2mXw7LkP4sZ8nB1cF6hJ3dG5yU0aEiOQe/x in ~/.aws", "found *** in ~/.aws"),
        ("key id AKIAIOSFODNN7EXAMPLE", "key id ***"),
        (f"clone with {GH_PAT}", "clone with ***"),
        ('{"password": "hunter2-x"}', '{"password": "***"}'),
        ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30", "Authorization: Bearer ***"),
        # What is no secret stays readable: counts, hex digests, paths, plain URLs.
        (
            "step 10 loss=1.25 max_new_tokens=2048 supervised_tokens=123456",
            "step 10 loss=1.25 max_new_tokens=2048 supervised_tokens=123456",
        ),
        (
            "rev 3f2a1b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a md5 0123456789abcdef0123456789abcdef",
            "rev 3f2a1b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a md5 0123456789abcdef0123456789abcdef",
        ),
        ("GET https://hf.co/api/models?limit=5", "GET https://hf.co/api/models?limit=5"),
        (
            "credentials: environment (AWS_ACCESS_KEY_ID)",
            "credentials: environment (AWS_ACCESS_KEY_ID)",
        ),
        ("aws_session_token=FwoGZXIvYXdzEBY", "aws_session_token=***"),
    ],
)
def test_redact_text_scrubs_secret_shapes(text: str, redacted: str) -> None:
    assert redaction.redact_text(text, []) == redacted


def test_project_settings_keep_their_value_without_credentials() -> None:
    """DRAFTLINE_* values are recorded, but the user info, query and token-like path segments
    of their URLs are not, and those parts are scrubbed from free text."""
    env = {
        "DRAFTLINE_SGLANG_ENDPOINTS": "http://svc:Pw0rd-x@10.0.0.5:30000/v1?api_key=k1,"
        "http://10.0.0.6:30000",
        "DRAFTLINE_NOTIFY": "https://hooks.example/T0NODE/Xy9AbCdEf",
        "DVC_NO_ANALYTICS": "1",
        "DVC_STUDIO_TOKEN": "isat_abc",
    }
    assert redaction.redact_env(env) == {
        "values": {
            "DRAFTLINE_NOTIFY": "https://hooks.example/***",
            "DRAFTLINE_SGLANG_ENDPOINTS": "http://10.0.0.5:30000/v1?***,http://10.0.0.6:30000",
            "DVC_NO_ANALYTICS": "1",
        },
        "names_only": ["DVC_STUDIO_TOKEN"],
    }
    secrets = redaction.secret_values(env)
    line = "curl -u svc:Pw0rd-x http://10.0.0.5:30000/health; key k1 notify T0NODE Xy9AbCdEf"
    assert redaction.redact_text(line, secrets) == (
        "curl -u *** http://10.0.0.5:30000/health; key *** notify *** ***"
    )


def test_short_secrets_by_name_and_their_encoded_forms() -> None:
    """No minimum length when the name looks secret; a short one only as a whole word."""
    env = {"DB_PASS_SHORT": "k9#Xq", "MY_SERVICE_CRED": "c7-ab", "APP_PWD": "zz1", "PWD": "/w"}
    secrets = redaction.secret_values(env)
    text = (
        "login k9#Xq; cred c7-ab; pwd zz1; url pw=" + urllib.parse.quote("k9#Xq", safe="")
        + "; json " + json.dumps({"p": 'k9#Xq"'}) + "; word azz1b and /w/x stay"
    )  # fmt: skip
    out = redaction.redact_text(text, secrets)
    assert out == (
        'login ***; cred ***; pwd ***; url pw=***; json {"p": "***\\""}; word azz1b and /w/x stay'
    )


def test_unknown_variables_are_secrets_unless_plainly_not() -> None:
    env = {
        "MY_APP_CONFIG": "x9-opaque-value",
        "AWS_RETRY_MODE": "standard",
        "SSH_CLIENT": "10.0.0.1 5555 22",
        "EXTRA_DIRS": "/opt/a:/opt/b",
        "HOME": "/home/u",
    }
    assert redaction.secret_values(env) == ["x9-opaque-value"]


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        ("curl --user bob:s3cr3t http://x", "curl --user bob:*** http://x"),
        ("curl -u bob:s3cr3t http://x", "curl -u bob:*** http://x"),
        ("MY_SERVICE_CRED=abc12", "MY_SERVICE_CRED=***"),
        ("token eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig", "token ***"),
        ("random Xk29fLq8ZmW3pR7tYb2N here", "random *** here"),
        ("class Qwen3_5ForConditionalGeneration", "class Qwen3_5ForConditionalGeneration"),
        ("tokens 2048 embeddings ready", "tokens 2048 embeddings ready"),
    ],
)
def test_new_secret_shapes(text: str, redacted: str) -> None:
    assert redaction.redact_text(text, []) == redacted


def test_a_lowercase_value_of_an_innocent_name_is_a_secret_as_a_whole_word() -> None:
    """A plain lowercase value proves nothing: scrubbed where it stands alone, never inside
    another word; setting words (`standard`) and short values stay."""
    env = {"RUN_LABEL": "mqtwzoxkvbrhe", "AWS_RETRY_MODE": "standard", "STAGE": "dev"}
    secrets = redaction.secret_values(env)
    assert "mqtwzoxkvbrhe" in secrets and "standard" not in secrets and "dev" not in secrets
    text = "mqtwzoxkvbrhe\nlabel=mqtwzoxkvbrhe; mode standard; xmqtwzoxkvbrhes stays"
    assert redaction.redact_text(text, secrets) == (
        "***\nlabel=***; mode standard; xmqtwzoxkvbrhes stays"
    )


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        (f"> Authorization: Token {'3f9a' * 10}", "> Authorization: Token ***"),
        ("run pass=Qx7pL steps=3", "run pass=*** steps=3"),
        ("Authorization: ApiKey k-9f8e7d6c", "Authorization: ApiKey ***"),
        ("Proxy-Authorization: Negotiate YIIBhwYGKwYBBQUC", "Proxy-Authorization: Negotiate ***"),
        ('{"authorization": "Token 0a1b2c3d4e"}', '{"authorization": "Token ***"}'),
        ("authorization=Zm9vOmJhcg==", "authorization=***"),
        ("Cookie: sessionid=zz9Qp; csrftoken=abc", "Cookie: ***"),
        ("GET /cb#access_token=tok-123abc&x=1", "GET /cb#access_token=***&x=1"),
        ("pw: Hq3z", "pw: ***"),
        ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30", "Authorization: Bearer ***"),
        ("bypass=true compass=north", "bypass=true compass=north"),
    ],
)
def test_header_and_short_password_shapes(text: str, redacted: str) -> None:
    assert redaction.redact_text(text, []) == redacted


def test_a_json_value_under_a_secret_key_goes_whole() -> None:
    data = {"headers": {"authorization": "Token 0a1b2c3d4e5f"}, "hf_token": "abc",
            "tokenizer": "Qwen/Qwen3-8B", "max_new_tokens": 64, "db_password": ""}  # fmt: skip
    assert redaction.redact_data(data, []) == {
        "headers": {"authorization": "***"}, "hf_token": "***", "tokenizer": "Qwen/Qwen3-8B",
        "max_new_tokens": 64, "db_password": "",
    }  # fmt: skip


def test_a_credential_copied_without_its_header_is_scrubbed() -> None:
    """A run log's `"auth_header": "Token <hex>"`: by its key (camelCase too), and by its
    shape in free text; words after `token` stay."""
    token = "9f8e7d6c5b4a39281706f5e4d3c2b1a0f9e8d7c6"
    data = {"auth_header": f"Token {token}", "authHeader": "x", "token_count": "12",
            "note": f"called with Token {token}", "auth_mode": "sso"}  # fmt: skip
    assert redaction.redact_data(data, []) == {
        "auth_header": "***", "authHeader": "***", "token_count": "12",
        "note": "called with Token ***", "auth_mode": "sso",
    }  # fmt: skip
    for plain in ("token embeddings per second", "first token 1234567890123456789"):
        assert redaction.redact_text(plain, []) == plain


def test_holds_secret_is_whether_redaction_changes_the_text() -> None:
    for secret in ("sk-live-Ab3dEf6hIj9kLm2nOp5qRs8t", f"add {GH_PAT}", f"ci {SECRET}"):
        assert redaction.holds_secret(secret)
    for plain in ("ep-one", "lr-0.001", "salvage: dvc.lock and notes from node-3", "tokenizer"):
        assert not redaction.holds_secret(plain)
