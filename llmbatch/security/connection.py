"""Where and how every llm-batch process connects to Temporal.

Configured the way Temporal's own tools are, through the SDK's environment
configuration (:mod:`temporalio.envconfig`): ``TEMPORAL_ADDRESS``,
``TEMPORAL_NAMESPACE``, ``TEMPORAL_API_KEY``, ``TEMPORAL_TLS``,
``TEMPORAL_TLS_SERVER_CA_CERT_PATH``/``_DATA``, ``TEMPORAL_TLS_CLIENT_CERT_PATH``/
``_DATA``, ``TEMPORAL_TLS_CLIENT_KEY_PATH``/``_DATA``, ``TEMPORAL_TLS_SERVER_NAME``,
``TEMPORAL_GRPC_META_*``, and a profile (``TEMPORAL_PROFILE``, default ``default``) of
Temporal's TOML file (``TEMPORAL_CONFIG_FILE``, else
``~/.config/temporalio/temporal.toml``).

Precedence, highest first, for the address and the namespace:

1. llm-batch's own ``LLMBATCH_TEMPORAL_ADDRESS`` / ``LLMBATCH_TEMPORAL_NAMESPACE``
   (or the same keys in ``llm-batch.toml``), when set: the setting that names
   llm-batch is the more specific one;
2. ``TEMPORAL_ADDRESS`` / ``TEMPORAL_NAMESPACE``;
3. the profile in Temporal's TOML file;
4. llm-batch's defaults (``127.0.0.1:7233``, namespace ``llm-batch``).

TLS, client certificates, the API key and gRPC metadata come only from Temporal's
configuration (2 and 3, the environment over the file), so one setting means one
thing for the ``temporal`` CLI and for llm-batch.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from temporalio.envconfig import ClientConfigProfile, ClientConfigTLS, DataSource
from temporalio.service import TLSConfig

from llmbatch.config import Settings
from llmbatch.errors import LlmBatchError

CA_SETTING = "TEMPORAL_TLS_SERVER_CA_CERT_PATH"
CERT_SETTING = "TEMPORAL_TLS_CLIENT_CERT_PATH"
KEY_SETTING = "TEMPORAL_TLS_CLIENT_KEY_PATH"
API_KEY_SETTING = "TEMPORAL_API_KEY"


class ConnectionConfigError(LlmBatchError, ValueError):
    """Temporal's connection settings cannot be used (one line, no secret in it)."""


@dataclass(frozen=True)
class TemporalTarget:
    """Everything ``Client.connect`` needs besides the data converter."""

    address: str
    namespace: str
    tls: bool | TLSConfig = False
    api_key: str | None = field(default=None, repr=False)
    rpc_metadata: Mapping[str, str] = field(default_factory=dict, repr=False)
    client_cert: str | None = None  # where the client certificate came from, for messages

    @property
    def security(self) -> str:
        """How the connection is secured, in words: shown in errors and ready lines."""
        if self.tls is False:
            return "plain text"
        mode = "mutual TLS" if self.client_cert else "TLS"
        return f"{mode} with an API key" if self.api_key else mode

    def describe(self) -> str:
        return f"Temporal at {self.address} (namespace {self.namespace}, {self.security})"


def temporal_target(
    settings: Settings, *, environ: Mapping[str, str] | None = None
) -> TemporalTarget:
    """Resolve the connection of ``settings`` (see the module docstring for precedence).

    ``environ`` replaces the process environment (tests). Raises
    :class:`ConnectionConfigError` for a missing profile, an unreadable certificate or
    key, or a client certificate that has expired or is not yet valid.
    """
    config_file = (os.environ if environ is None else environ).get("TEMPORAL_CONFIG_FILE")
    if config_file and not Path(config_file).is_file():
        # The SDK would go on without it, silently, to the defaults.
        raise ConnectionConfigError(
            f"Temporal's config file {config_file} (TEMPORAL_CONFIG_FILE) does not exist"
        )
    try:
        profile = ClientConfigProfile.load(override_env_vars=environ)
    except Exception as exc:  # the bridge raises its own ConfigError type
        raise ConnectionConfigError(f"Temporal's client configuration: {exc}") from None
    explicit = settings.model_fields_set
    address = (
        settings.temporal_address
        if "temporal_address" in explicit or not profile.address
        else profile.address
    )
    namespace = (
        settings.temporal_namespace
        if "temporal_namespace" in explicit or not profile.namespace
        else profile.namespace
    )
    tls: bool | TLSConfig = profile.api_key is not None
    client_cert: str | None = None
    if profile.tls is not None:
        _check_tls_files(profile.tls)
        try:
            tls = profile.tls.to_connect_tls_config()
        except OSError as exc:
            raise ConnectionConfigError(
                f"cannot read a TLS file for Temporal: {exc.filename}: {exc.strerror}"
            ) from None
        if isinstance(tls, TLSConfig) and tls.client_cert is not None:
            client_cert = _source_name(profile.tls.client_cert, CERT_SETTING)
            if tls.client_private_key is None:
                raise ConnectionConfigError(
                    f"a client certificate ({client_cert}) without its key: set {KEY_SETTING}"
                )
    return TemporalTarget(
        address=address,
        namespace=namespace,
        tls=tls,
        api_key=profile.api_key,
        rpc_metadata=dict(profile.grpc_meta),
        client_cert=client_cert,
    )


def _source_name(source: DataSource | None, setting: str) -> str:
    return str(source) if isinstance(source, Path) else f"{setting.removesuffix('_PATH')}_DATA"


def _check_tls_files(tls: ClientConfigTLS) -> None:
    """Fail here, in words, on what the TLS handshake would fail on obscurely."""
    source = tls.client_cert
    if source is None:
        return
    try:
        raw = (
            source.read_bytes()
            if isinstance(source, Path)
            else (source.encode() if isinstance(source, str) else source)
        )
        from cryptography import x509  # only where a certificate is read

        cert = x509.load_pem_x509_certificate(raw)
    except OSError as exc:
        raise ConnectionConfigError(
            f"cannot read the client certificate {_source_name(source, CERT_SETTING)}: "
            f"{exc.strerror}"
        ) from None
    except ValueError:
        raise ConnectionConfigError(
            f"the client certificate {_source_name(source, CERT_SETTING)} is not a PEM certificate"
        ) from None
    now = dt.datetime.now(dt.UTC)
    name = _source_name(source, CERT_SETTING)
    if cert.not_valid_after_utc < now:
        raise ConnectionConfigError(
            f"the client certificate {name} expired on "
            f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: renew it"
        )
    if cert.not_valid_before_utc > now:
        raise ConnectionConfigError(
            f"the client certificate {name} is not valid before "
            f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"
        )


# What the gRPC stack says, and what it means: the first pattern that matches wins.
_CAUSES: tuple[tuple[str, str], ...] = (
    (r"Expired", "the server's TLS certificate has expired"),
    (
        r"UnknownIssuer|BadSignature|UnknownCA",
        "the server's TLS certificate is not signed by a CA this client trusts "
        f"(name its CA with {CA_SETTING})",
    ),
    (
        r"NotValidForName",
        "the server's TLS certificate is not for this address "
        "(TEMPORAL_TLS_SERVER_NAME names the one it is for)",
    ),
    (
        r"InvalidContentType|CorruptMessage|InvalidMessage",
        "the TLS handshake failed: the server does not speak TLS at this address "
        "(turn TLS off, or use its TLS address)",
    ),
)


def explain_connect_error(exc: BaseException, target: TemporalTarget) -> str:
    """One line saying why connecting to ``target`` failed, naming the cause."""
    text = " ".join(str(exc).split())
    has_cert = target.client_cert is not None
    if re.search(r"AlertReceived\((CertificateRequired|HandshakeFailure)\)", text) or (
        "400 Bad Request" in text and not has_cert
    ):
        cause = f"the server requires a client certificate: set {CERT_SETTING} and {KEY_SETTING}"
    elif re.search(r"AlertReceived\((BadCertificate|CertificateExpired|UnknownCA|"
                   r"CertificateUnknown|CertificateRevoked|AccessDenied)\)", text) or (
        "400 Bad Request" in text and has_cert
    ):  # fmt: skip
        cause = (
            f"the server refused the client certificate {target.client_cert}: not signed "
            "by a CA it trusts, expired or revoked"
        )
    elif re.search(r"401 Unauthorized|Unauthenticated|PermissionDenied|[Uu]nauthori[sz]ed", text):
        cause = (
            f"the server refused the API key ({API_KEY_SETTING})"
            if target.api_key
            else f"the server requires an API key ({API_KEY_SETTING}) or other credentials"
        )
    elif re.search(r"Connection refused|ConnectionRefused", text):
        cause = "nothing accepts connections at this address"
    elif target.tls is False and re.search(
        r"FRAME_SIZE_ERROR|frame with invalid size|h2 protocol error|Canceled|"
        r"connection closed|connection reset|BrokenPipe",
        text,
    ):
        # A TLS server reads a plain-text HTTP/2 preface as garbage and hangs up.
        cause = (
            "the server hung up on a plain-text client: it speaks TLS at this address and "
            f"this client does not (set TEMPORAL_TLS=true, or a CA with {CA_SETTING})"
        )
    else:
        cause = next((why for pattern, why in _CAUSES if re.search(pattern, text)), "")
        if not cause:
            # Unknown: the gRPC stack's own words, cut to a line, never a key in them.
            cause = _scrub(text, target)[:300]
    return f"cannot reach {target.describe()}: {cause}"


def _scrub(text: str, target: TemporalTarget) -> str:
    if target.api_key:
        text = text.replace(target.api_key, "***")
    return text
