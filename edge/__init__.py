"""The HTTP edge: ``ratchet serve`` (REST, SSE, AG-UI) on top of the cluster client.

``edge.app.create_app(client, options)`` builds the FastAPI application; the web
framework is imported only by ``edge.app`` and the modules it uses, so importing this
package (or ``edge.cli``) stays cheap. Nothing in ``runtime/`` imports from here.
"""

from edge.options import ServeOptions, ServeRefused

__all__ = ["ServeOptions", "ServeRefused"]
