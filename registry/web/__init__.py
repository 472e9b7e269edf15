"""Web: server-rendered HTML pages over the same services and read rule as the API.

Pages (no JavaScript, no build step; Jinja2 templates with autoescaping and one stylesheet):

- `/ui/`                                         models, their latest release and channels
- `/ui/models/{model}`                           releases (yanked ones marked) and channels
- `/ui/models/{model}/releases/{version}`        the artifact × eval-metrics matrix, file downloads
- `/ui/models/{model}/channels/{channel}`        a channel's promotion history
- `/ui/audit[?model=]`                           the audit log

`/` redirects to `/ui/`. Errors (404 and the rest) are small HTML pages with the error's message.
"""
