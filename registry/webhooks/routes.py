"""/v1/webhooks: subscribe to registry events, read the delivery log, redeliver (admin scope); changes are audited."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from kiln.registry.api.endpoint import SessionRoute
from kiln.registry.api.errors import error_responses
from kiln.registry.api.pages import PAGED, page_rows
from kiln.registry.api.params import AfterId, PageLimit, RowId
from kiln.registry.auth.principal import Principal
from kiln.registry.deps import SessionDep, WriteSessionDep, require
from kiln.registry.paging import PAGE_LIMIT
from kiln.registry.webhooks import service
from kiln.registry.webhooks.destinations import DestinationPolicy
from kiln.registry.webhooks.schemas import DeliveryOut, WebhookCreate, WebhookCreated, WebhookOut

router = APIRouter(prefix="/v1", tags=["webhooks"], route_class=SessionRoute)
Admin = Annotated[Principal, require("admin")]


def get_destinations(request: Request) -> DestinationPolicy:
    policy: DestinationPolicy = request.app.state.webhook_destinations
    return policy


DestinationsDep = Annotated[DestinationPolicy, Depends(get_destinations)]


@router.post(
    "/webhooks",
    status_code=201,
    summary="Create a webhook (its signing secret is returned once); its URL must be public or allow-listed",
)
def create_webhook(
    spec: WebhookCreate, session: WriteSessionDep, principal: Admin, destinations: DestinationsDep
) -> WebhookCreated:
    webhook, secret = service.create_webhook(
        session,
        principal,
        url=spec.url,
        events=spec.events,
        model_pattern=spec.model_pattern,
        destinations=destinations,
        secret=spec.secret,
    )
    session.commit()
    return WebhookCreated.of(webhook, secret=secret)


@router.get(
    "/webhooks",
    summary="List webhooks, active or deleted (never their secrets), oldest first, a page at a time",
    responses=PAGED,
)
def list_webhooks(
    request: Request,
    response: Response,
    session: SessionDep,
    principal: Admin,
    after: AfterId = None,
    limit: PageLimit = PAGE_LIMIT,
) -> list[WebhookOut]:
    page = service.webhooks_page(session, principal, after, limit)
    return [WebhookOut.of(w) for w in page_rows(request, response, page, limit)]


@router.get("/webhooks/{webhook_id}", summary="A webhook (never its secret)", responses=error_responses(404))
def get_webhook(webhook_id: RowId, session: SessionDep, principal: Admin) -> WebhookOut:
    return WebhookOut.of(service.get_webhook(session, principal, webhook_id))


@router.delete(
    "/webhooks/{webhook_id}",
    summary="Delete a webhook: it gets no more events and its pending deliveries stop (its log is kept)",
    responses=error_responses(404),
)
def delete_webhook(webhook_id: RowId, session: WriteSessionDep, principal: Admin) -> WebhookOut:
    webhook = service.deactivate_webhook(session, principal, webhook_id)
    session.commit()
    return WebhookOut.of(webhook)


@router.get(
    "/webhooks/{webhook_id}/deliveries",
    summary="A webhook's delivery log, newest first, with every attempt, a page at a time",
    responses={**PAGED, **error_responses(404)},
)
def list_deliveries(
    webhook_id: RowId,
    request: Request,
    response: Response,
    session: SessionDep,
    principal: Admin,
    after: AfterId = None,
    limit: PageLimit = PAGE_LIMIT,
) -> list[DeliveryOut]:
    page = service.deliveries_page(session, principal, webhook_id, after, limit)
    return [DeliveryOut.of(d, attempt_log=d.attempt_log) for d in page_rows(request, response, page, limit)]


@router.post(
    "/webhooks/{webhook_id}/deliveries/{delivery_id}/redeliver",
    status_code=201,
    summary="Send a delivered or failed delivery's event again, as a new delivery",
    responses=error_responses(404, 409),
)
def redeliver(webhook_id: RowId, delivery_id: RowId, session: WriteSessionDep, principal: Admin) -> DeliveryOut:
    delivery = service.redeliver(session, principal, webhook_id, delivery_id)
    session.commit()
    return DeliveryOut.of(delivery, attempt_log=[])
