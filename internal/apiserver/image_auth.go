package apiserver

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"strings"

	"connectrpc.com/connect"
	"github.com/google/go-containerregistry/pkg/name"

	"github.com/kernflux/opendsec/api/gen/opendsec/node/v1/nodev1connect"
	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/image"
)

// adminScope and adminHint say how to get the scope the image store's
// guarded calls need.
const (
	adminScope = "an admin token (create one with `opendsec token create --scope admin`)"
	adminHint  = adminScope + " is needed"
)

// isAdmin reports whether the caller's verified token has the admin scope.
func isAdmin(ctx context.Context) bool {
	c, ok := auth.FromContext(ctx)
	return ok && c.Scope == auth.ScopeAdmin
}

// requireAdmin refuses what (e.g. "removing an image") unless the caller is
// an admin.
func requireAdmin(ctx context.Context, what string) error {
	if isAdmin(ctx) {
		return nil
	}
	return errdefs.New(errdefs.ErrPermissionDenied, "%s: %s", what, adminHint)
}

// requireAdminToReplace refuses a non-admin caller a call that would give
// the name (request field field) to a new image when the name already
// names one: replacing an image, e.g. root/py:3.11 that every user's
// sandboxes start from, is for admins.
func requireAdminToReplace(ctx context.Context, c nodev1connect.NodeImageServiceClient, field, imageName string) error {
	if isAdmin(ctx) || imageName == "" {
		return nil
	}
	_, err := c.GetImage(ctx, connect.NewRequest(&v1.GetImageRequest{Name: imageName}))
	if err == nil {
		return errdefs.New(errdefs.ErrPermissionDenied, "%s: image %s exists and replacing an image needs admin rights; choose a new name, or %s", field, imageName, adminHint)
	}
	if err := remoteErr(ctx, "look up image", err); !errdefs.IsNotFound(err) {
		return err
	}
	return nil
}

// checkImport applies the import rules for a non-admin caller: no archive
// imports (they read the node's files), no registry on a loopback, private,
// link-local or otherwise internal address (the node would fetch from
// inside the cluster's network), and no replacing an existing image.
func checkImport(ctx context.Context, c nodev1connect.NodeImageServiceClient, m *v1.ImportImageRequest) error {
	if isAdmin(ctx) {
		return nil
	}
	ref := m.GetRef()
	if strings.HasPrefix(ref, image.SchemeOCILayout) || strings.HasPrefix(ref, image.SchemeDockerArchive) {
		return errdefs.New(errdefs.ErrPermissionDenied, "ref: importing a node's archive (oci-layout:, docker-archive:) reads the node's files; %s", adminHint)
	}
	r, err := name.ParseReference(ref)
	if err != nil {
		return errdefs.Invalid("ref", "%q is not an image reference: %v; use REGISTRY/REPOSITORY[:TAG|@sha256:DIGEST]", ref, err)
	}
	registry := r.Context().RegistryStr()
	if err := requirePublicRegistry(ctx, registry); err != nil {
		return err
	}
	target := m.GetName()
	if target == "" {
		if target, err = image.NameFromRef(ref); err != nil {
			return errdefs.Invalid("ref", "%v", err)
		}
	}
	return requireAdminToReplace(ctx, c, "name", target)
}

// requirePublicRegistry refuses a registry host that is, or resolves to,
// an address inside the cluster's networks.
func requirePublicRegistry(ctx context.Context, registry string) error {
	host := registry
	if h, _, err := net.SplitHostPort(registry); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	var addrs []netip.Addr
	if a, err := netip.ParseAddr(host); err == nil {
		addrs = []netip.Addr{a}
	} else {
		addrs, err = net.DefaultResolver.LookupNetIP(ctx, "ip", host)
		if err != nil {
			var dnsErr *net.DNSError
			if errors.As(err, &dnsErr) && dnsErr.IsNotFound {
				return errdefs.Invalid("ref", "registry host %q does not resolve; check the reference", host)
			}
			return errdefs.New(errdefs.ErrUnavailable, "ref: resolve registry host %q: %w", host, err)
		}
	}
	for _, a := range addrs {
		if image.IsInternalAddr(a) {
			return errdefs.New(errdefs.ErrPermissionDenied, "ref: registry %s is at %s, a loopback, private or link-local address; importing from it needs %s", registry, a, adminScope)
		}
	}
	return nil
}

// nodeImportRequest is the node's request for an import m. The node
// learns who asked from the caller's own signed token, which every call
// made in the caller's context forwards (auth.OnBehalfHeader), and lets
// only an admin's import reach internal registries; for anyone else it
// connects only to public addresses, whatever the registry's name resolves
// to at the node (the check above resolved it here, which DNS rebinding can
// answer differently).
func nodeImportRequest(_ context.Context, m *v1.ImportImageRequest) *connect.Request[v1.ImportImageRequest] {
	return connect.NewRequest(m)
}
