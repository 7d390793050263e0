package node

import (
	"context"

	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
)

// Ownership. Every sandbox records its owner (the principal that created
// it, and its project, empty until projects exist), taken at create from
// the caller's verified claims: on a component's call on someone's behalf
// those of the signed token it forwarded (auth.OnBehalfHeader), never
// anything in the request body. A user-scope caller sees and acts on only
// the sandboxes it owns; admins and components acting on their own behalf
// (node scope: the watcher, the apiserver's housekeeping) see all. A
// sandbox the caller does not own answers not_found, like one that does
// not exist. Records from before owners were recorded have none and are
// visible to admins only. The node is the authority: the apiserver and the
// E2B gateway may filter too, but every check here holds without them.

// caller is who a NodeService call or agent request acts for.
type caller struct {
	all                bool // admin, or a component on its own behalf
	principal, project string
}

// callerOf returns the caller in ctx. A node served without authentication
// (tests of the node alone) has no claims: everything is visible, as no
// token guards it anyway.
func callerOf(ctx context.Context) caller {
	c, ok := auth.FromContext(ctx)
	if !ok || c.Scope == auth.ScopeAdmin || c.Scope == auth.ScopeNode {
		return caller{all: true, principal: c.Subject, project: c.Project}
	}
	return caller{principal: c.Subject, project: c.Project}
}

// ownerOf returns the owner a create in ctx records: the caller's
// principal and project. A component on its own behalf creates sandboxes
// nobody but admins own.
func ownerOf(ctx context.Context) (principal, project string) {
	c, ok := auth.FromContext(ctx)
	if !ok || c.Scope == auth.ScopeNode {
		return "", ""
	}
	return c.Subject, c.Project
}

// owns reports whether c may see and act on the sandbox recorded in rec.
func (c caller) owns(rec *record) bool {
	return c.all || (rec.Owner != "" && rec.Owner == c.principal && rec.Project == c.project)
}

// getFor returns sandbox id (or the warm-pool sandbox a create under id
// took) if the caller in ctx owns it, and not_found otherwise.
func (n *Node) getFor(ctx context.Context, id string) (*sandbox, error) {
	c := callerOf(ctx)
	n.mu.Lock()
	defer n.mu.Unlock()
	sb, ok := n.sandboxes[id]
	if !ok {
		if real, aliased := n.aliases[id]; aliased {
			sb, ok = n.sandboxes[real]
		}
	}
	if !ok || !c.owns(sb.rec) {
		return nil, errdefs.New(errdefs.ErrNotFound, "sandbox %s not found", id)
	}
	return sb, nil
}

// getOrDeadFor is getFor that also finds a sandbox that died lately (its
// tombstone, see exit.go), for Get and for telling callers why it is gone.
func (n *Node) getOrDeadFor(ctx context.Context, id string) (sb *sandbox, dead bool, err error) {
	sb, err = n.getFor(ctx, id)
	if !errdefs.IsNotFound(err) {
		return sb, false, err
	}
	if d, ok := n.deadSandbox(id); ok && callerOf(ctx).owns(d.rec) {
		return d, true, nil
	}
	return nil, false, err
}

// checkOwner fails with not_found unless the caller in ctx owns sandbox id.
func (n *Node) checkOwner(ctx context.Context, id string) error {
	_, err := n.getFor(ctx, id)
	return err
}

// ownedBy restricts sel to the sandboxes the caller in ctx owns.
func ownedBy(ctx context.Context, sel Selector) Selector {
	if c := callerOf(ctx); !c.all {
		sel.owner = c.owns
	}
	return sel
}
