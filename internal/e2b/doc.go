// Package e2b serves E2B's API so programs written for E2B's SDKs run on
// OpenDsec after changing E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY.
//
// One http.Handler serves two things on one listener:
//
//   - the control-plane REST API (POST /sandboxes, GET /v2/sandboxes, ...),
//     authenticated with E2B API keys (e2b_<40 hex>, see KeyStore) and
//     served by calling OpenDsec's public API with a service token;
//   - the sandbox traffic proxy: a request carrying E2b-Sandbox-Id and
//     E2b-Sandbox-Port headers, or sent to Host <port>-<id>.<domain>, goes to
//     the sandbox. Port 49983 (envd) reaches the sandbox's agent through its
//     node (<node>/agent/<id>/...); any other port goes through the agent's
//     TCP tunnel to that port inside the sandbox.
//
// The gateway keeps no per-sandbox state: E2B fields OpenDsec has no place
// for (metadata, template, secure, owning key) travel as sandbox labels, and
// a sandbox's envd access token is an HMAC of its ID.
package e2b
