"""/v1/metaserver: an engine's call in trigger mode (MindIE's protocol): a chat or completions body plus the PD
control object, whose job is that family's (serving/trigger.py forwards it)."""

from __future__ import annotations

from errors import InvalidRequest
from serving.families.base import Family
from serving.families.chat import CHAT
from serving.families.completions import COMPLETIONS
from serving.protocol import validate
from serving.protocol.metaserver import MetaserverCall


class Metaserver(Family):
    route = "/v1/metaserver"

    def call(self, body: dict) -> tuple[Family, dict, str]:
        call = validate(MetaserverCall, body)
        family = CHAT if "messages" in body else COMPLETIONS if "prompt" in body or "prompt_embeds" in body else None
        if family is None:
            raise InvalidRequest("one of 'messages' or 'prompt' is required", param="messages")
        return family, body["kv_transfer_params"], call.kv_transfer_params.request_id


METASERVER = Metaserver()
