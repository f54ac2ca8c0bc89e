"""The Responses API (`/v1/responses`): request translation, events, storage and routes."""
