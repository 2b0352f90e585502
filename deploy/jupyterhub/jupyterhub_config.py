# LooseLeaf as a JupyterHub (6.0 or later) service (ADR 67): what a Hub's own
# jupyterhub_config.py adds so that its users' notebooks run on one shared
# LooseLeaf frontend, with no LooseLeaf token of their own. Load it at the end
# of yours (it appends to c.JupyterHub.services, which a later assignment would
# drop):
#
#     load_subconfig("/path/to/looseleaf/deploy/jupyterhub/jupyterhub_config.py")
#
# with, in the Hub's environment:
#   LOOSELEAF_FRONTEND_URL      the frontend as browsers reach it (its dashboard
#                               and the OAuth callback), e.g. https://looseleaf.example.org
#   LOOSELEAF_HUB_SERVICE_TOKEN the service's Hub API token; the frontend reads the
#                               same one (--jupyterhub-token-file)
#
# The frontend runs with --jupyterhub-api-url http://HUB:8081/hub/api
# --jupyterhub-url https://HUB (the Hub as browsers reach it), and each user's
# image has the kernelspec and the extension:
#
#     looseleaf kernel install --sys-prefix --frontend URL --token-env JUPYTERHUB_API_TOKEN
#     pip install looseleaf_jupyterlab-*.whl
#
# (docs/operations.md, "JupyterHub"). The authenticator and spawner stay the Hub's.
import os

c = get_config()  # noqa: F821 (JupyterHub's config loader defines it)

SERVICE = "looseleaf"
ACCESS = f"access:services!service={SERVICE}"
frontend = os.environ["LOOSELEAF_FRONTEND_URL"].rstrip("/")

c.JupyterHub.services.append(
    {
        "name": SERVICE,
        "api_token": os.environ["LOOSELEAF_HUB_SERVICE_TOKEN"],
        # the dashboard's login: the frontend is reached at its own address, not
        # through the Hub's proxy (so the Hub lists it under no Services menu:
        # give users the dashboard's address)
        "oauth_redirect_uri": f"{frontend}/hub/oauth_callback",
        "oauth_no_confirm": True,
    }
)

# every user may use the service (the dashboard's OAuth login asks it); whether
# a user is one of the Hub's admins comes with their identity
c.JupyterHub.extra_user_scopes.add(ACCESS)

# A user's server hands $JUPYTERHUB_API_TOKEN to its kernels; with the
# service's access scope added to the server role's own (its default two: if
# your Hub changed the `server` role, list its scopes here instead), the kernels
# use it as their LooseLeaf token.
c.Spawner.server_token_scopes = ["users:activity!user", "access:servers!server", ACCESS]
