"""The registry's clients: `RestClient`, the registry calls `Registry` makes as MLflow REST requests over the standard
library (a lookup answers in a fraction of a second, without importing MLflow), and `open_client`, which gives the
operator commands one: REST for an MLflow server, otherwise MLflow's own client. `client_errors` and `error_code`
read either client's refusals the same way.
"""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from types import SimpleNamespace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import MlflowClient


class RestError(RuntimeError):
    """An MLflow server's error answer (`error_code`: RESOURCE_DOES_NOT_EXIST, RESOURCE_ALREADY_EXISTS, ...)."""

    def __init__(self, error_code: str, message: str):
        super().__init__(message)
        self.error_code = error_code


class RestClient:
    """The registry calls `Registry` makes, as MLflow REST requests through urllib (no MLflow import).

    Credentials as MLflow's own client reads them: `MLFLOW_TRACKING_TOKEN`, or
    `MLFLOW_TRACKING_USERNAME` and `MLFLOW_TRACKING_PASSWORD`.
    """

    errors = (RestError,)

    def __init__(self, tracking_uri: str, timeout_s: float = 30):
        self.tracking_uri, self.timeout_s = tracking_uri.rstrip("/"), timeout_s

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if token := os.environ.get("MLFLOW_TRACKING_TOKEN"):
            headers["Authorization"] = f"Bearer {token}"
        elif user := os.environ.get("MLFLOW_TRACKING_USERNAME"):
            pair = f"{user}:{os.environ.get('MLFLOW_TRACKING_PASSWORD', '')}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()
        return headers

    def _call(self, method: str, endpoint: str, body: dict) -> dict:
        url = f"{self.tracking_uri}/api/2.0/mlflow/{endpoint}"
        data = None
        if method == "GET":  # as MLflow's client sends it: the fields as query parameters
            url += "?" + urllib.parse.urlencode(body)
        else:
            data = json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method, headers=self._headers())
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                payload = response.read()
        except urllib.error.HTTPError as exc:
            try:
                answer = json.loads(exc.read() or b"{}")
            except ValueError:
                answer = {}
            raise RestError(
                answer.get("error_code", f"HTTP {exc.code}"),
                answer.get("message", f"{method} {endpoint}: HTTP {exc.code}"),
            ) from None
        except urllib.error.URLError as exc:
            raise RestError("UNREACHABLE", f"MLflow at {self.tracking_uri} does not answer: {exc.reason}") from None
        return json.loads(payload) if payload else {}

    @staticmethod
    def _version(raw: dict) -> SimpleNamespace:
        tags = {t["key"]: t.get("value", "") for t in raw.get("tags", [])}
        return SimpleNamespace(
            name=raw["name"],
            version=str(raw["version"]),
            source=raw.get("source", ""),
            run_id=raw.get("run_id"),
            tags=tags,
        )

    def get_model_version_by_alias(self, name: str, alias: str) -> SimpleNamespace:
        return self._version(
            self._call("GET", "registered-models/alias", {"name": name, "alias": alias})["model_version"]
        )

    def get_model_version(self, name: str, version: str) -> SimpleNamespace:
        return self._version(
            self._call("GET", "model-versions/get", {"name": name, "version": version})["model_version"]
        )

    def set_registered_model_alias(self, name: str, alias: str, version: str) -> None:
        self._call("POST", "registered-models/alias", {"name": name, "alias": alias, "version": version})

    def delete_registered_model_alias(self, name: str, alias: str) -> None:
        self._call("DELETE", "registered-models/alias", {"name": name, "alias": alias})

    def set_model_version_tag(self, name: str, version: str, key: str, value: str) -> None:
        self._call("POST", "model-versions/set-tag", {"name": name, "version": version, "key": key, "value": value})

    def create_registered_model(self, name: str, tags: dict | None = None, description: str | None = None) -> None:
        body = {"name": name, "tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]}
        self._call("POST", "registered-models/create", body | ({"description": description} if description else {}))

    def get_registered_model(self, name: str) -> SimpleNamespace:
        raw = self._call("GET", "registered-models/get", {"name": name})["registered_model"]
        return SimpleNamespace(name=raw["name"], tags={t["key"]: t.get("value", "") for t in raw.get("tags", [])})

    def delete_registered_model(self, name: str) -> None:
        self._call("DELETE", "registered-models/delete", {"name": name})

    def create_model_version(self, name: str, source: str, tags: dict | None = None, **_: object) -> SimpleNamespace:
        body = {"name": name, "source": source, "tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]}
        return self._version(self._call("POST", "model-versions/create", body)["model_version"])

    def search_model_versions(self, filter_string: str) -> list:
        found, token = [], None
        while True:
            page = self._call(
                "GET",
                "model-versions/search",
                {"filter": filter_string, "max_results": 1000} | ({"page_token": token} if token else {}),
            )
            found += [self._version(raw) for raw in page.get("model_versions", [])]
            if not (token := page.get("next_page_token")):
                return found

    def delete_model_version(self, name: str, version: str) -> None:
        self._call("DELETE", "model-versions/delete", {"name": name, "version": version})


def open_client(tracking_uri: str) -> RestClient | MlflowClient:
    """A registry client for the operator commands: REST for an MLflow server, else MLflow's client."""
    if tracking_uri.startswith(("http://", "https://")):
        return RestClient(tracking_uri)
    import mlflow

    return mlflow.MlflowClient(tracking_uri)


def client_errors(client: RestClient | MlflowClient) -> tuple[type[BaseException], ...]:
    """What the client raises when the server says no (a missing alias, a name already taken)."""
    if hasattr(client, "errors"):  # a RestClient, or a wrapper of one (duck-typed: tests count its calls)
        return client.errors
    from mlflow.exceptions import MlflowException

    return (MlflowException,)


def error_code(exc: BaseException) -> str | None:
    """The error code of a client's error (RESOURCE_ALREADY_EXISTS, ...; UNREACHABLE from `RestClient`)."""
    return getattr(exc, "error_code", None)
