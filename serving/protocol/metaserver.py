"""A metaserver call's control object: an engine's PD forwarding call (pd_dispatch: trigger) is a chat or
completions body (serving/protocol/openai.py, checked as an engine's rewrite of a client body) plus
`kv_transfer_params`, vLLM's NixlConnector ticket. The dispatcher reads the ticket as it came."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator

from serving.protocol import VISIBLE, Body, ModelName, NonEmpty, Refusal, passed, refuse

MAX_REQUEST_ID = 128


class KvTransferParams(Body):
    request_id: Annotated[
        str,
        *NonEmpty,
        Field(json_schema_extra={"maxLength": MAX_REQUEST_ID, "pattern": f"^{VISIBLE.pattern}$"}),
        Refusal("'kv_transfer_params.request_id' is required"),
    ]
    do_remote_decode: passed(bool, "exactly one of do_remote_decode and do_remote_prefill is true") = False
    do_remote_prefill: passed(bool) = False
    remote_engine_id: passed(str | None) = None
    remote_host: passed(str | None) = None
    remote_port: passed(int | str | None) = None

    @field_validator("request_id")
    @classmethod
    def _visible(cls, rid: str) -> str:
        # The request's id in every log line (see VISIBLE) and the ticket both engines look the KV up by.
        if len(rid) > MAX_REQUEST_ID or not VISIBLE.fullmatch(rid):
            raise refuse(
                f"'kv_transfer_params.request_id' must be at most {MAX_REQUEST_ID} characters of printable ASCII"
                " without spaces",
                param="kv_transfer_params.request_id",
            )
        return rid

    @model_validator(mode="after")
    def _one_direction(self) -> KvTransferParams:
        if bool(self.do_remote_prefill) == bool(self.do_remote_decode):
            raise refuse(
                "exactly one of kv_transfer_params.do_remote_prefill and do_remote_decode must be true",
                param="kv_transfer_params",
            )
        return self


class MetaserverCall(Body):
    """What a metaserver call is checked for before its body's kind (chat or completions) is known."""

    model: ModelName
    kv_transfer_params: Annotated[KvTransferParams, Refusal("'kv_transfer_params' is required and must be an object")]
