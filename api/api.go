// Package api holds OpenDsec's wire contracts: the protobuf files in proto/
// and the code generated from them in gen/ (committed; a test fails when it
// is stale). The E2B envd protos (packages process and filesystem) are
// frozen: E2B's SDKs hard-code their paths.
package api
