package daemon

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/e2b"
)

// E2BKeyFile holds the E2B API keys (hashes) inside the data dir.
const E2BKeyFile = "e2b/keys.json"

func e2bKeys(cfg config.Config) *e2b.KeyStore {
	return e2b.NewKeyStore(filepath.Join(cfg.DataDir, E2BKeyFile))
}

// RunE2B serves the E2B-compatible gateway until ctx ends. It is an issuer
// (it holds the private key): for each API key's principal it mints a
// user-scope token and calls the apiserver with it, so the principal sees
// and acts on only its own sandboxes. Its own admin-scope service token is
// for the traffic proxy's sandbox lookups (envd traffic carries no API
// key); a node-scope one reaches sandboxes through the nodes. All are
// short-lived and renewed.
func RunE2B(ctx context.Context, cfg config.Config, iss *auth.Issuer, ready chan<- string) error {
	apiTok, err := startServiceToken(ctx, iss, "e2b-gateway", auth.ScopeAdmin)
	if err != nil {
		return err
	}
	nodeTok, err := startServiceToken(ctx, iss, "e2b-gateway", auth.ScopeNode)
	if err != nil {
		return err
	}
	apiAddr := cfg.E2B.APIAddress
	if apiAddr == "" {
		apiAddr = "http://" + cfg.APIServer.Listen
	}
	hc := h2cClient()
	api := opendsecv1connect.NewSandboxServiceClient(hc, strings.TrimRight(apiAddr, "/"),
		connect.WithInterceptors(auth.ClientInterceptorFrom(apiTok)))
	snaps := opendsecv1connect.NewSnapshotServiceClient(hc, strings.TrimRight(apiAddr, "/"),
		connect.WithInterceptors(auth.ClientInterceptorFrom(apiTok)))
	images := opendsecv1connect.NewImageServiceClient(hc, strings.TrimRight(apiAddr, "/"),
		connect.WithInterceptors(auth.ClientInterceptorFrom(apiTok)))
	nodes, err := nodeDirectory(cfg)
	if err != nil {
		return err
	}
	gw, err := e2b.New(e2b.Config{
		API:                   api,
		Snapshots:             snaps,
		Images:                images,
		Builder:               e2b.NewImageBuilder(images),
		StateDir:              filepath.Join(cfg.DataDir, "e2b"),
		Keys:                  e2bKeys(cfg),
		Nodes:                 nodes,
		NodeHTTPClient:        hc,
		NodeTokens:            nodeTok,
		Tokens:                iss,
		Secret:                iss.DeriveKey("opendsec e2b envd access tokens"),
		Domain:                cfg.E2B.Domain,
		Templates:             cfg.E2B.Templates,
		DenyInternetByDefault: cfg.E2B.DefaultInternetAccess != nil && !*cfg.E2B.DefaultInternetAccess,
		NoPrivilegeEscalation: cfg.E2B.AllowPrivilegeEscalation != nil && !*cfg.E2B.AllowPrivilegeEscalation,
	})
	if err != nil {
		return fmt.Errorf("e2b gateway: %w", err)
	}
	return serve(ctx, "e2b", cfg.E2B.Listen, gw, ready)
}

func e2bCommand(g *globalFlags) *cobra.Command {
	c := &cobra.Command{Use: "e2b", Short: "the E2B-compatible gateway and its API keys"}
	serveCmd := &cobra.Command{
		Use:   "serve",
		Short: "run only the E2B gateway (opendsec up runs it too)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := g.load()
			if err != nil {
				return err
			}
			// The gateway mints tokens for its keys' principals: it runs
			// where the issuer's private key is.
			iss, err := auth.LoadIssuer(cfg.PrivateKeyPath())
			if err != nil {
				return err
			}
			return RunE2B(cmd.Context(), cfg, iss, nil)
		},
	}
	keys := &cobra.Command{Use: "key", Short: "manage E2B API keys"}
	var principal string
	create := &cobra.Command{
		Use:   "create",
		Short: "print a new E2B API key (e2b_<40 hex>) for E2B_API_KEY",
		Long: `create makes a new E2B API key, stores its hash in the data dir and
prints the key; it is shown only once. Sandboxes created with a key belong to
its principal and are visible to every key of that principal.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := g.load()
			if err != nil {
				return err
			}
			k, err := e2bKeys(cfg).Create(principal)
			if err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), k)
			return nil
		},
	}
	create.Flags().StringVar(&principal, "principal", "default", "OpenDsec principal the key acts as")
	keys.AddCommand(create)
	c.AddCommand(serveCmd, keys)
	return c
}

// NewE2BCommand returns the command of the opendsec-e2b binary: the gateway,
// with `key create` as a subcommand.
func NewE2BCommand() *cobra.Command {
	var g globalFlags
	c := e2bCommand(&g)
	serveCmd, _, _ := c.Find([]string{"serve"})
	c.Use = "opendsec-e2b"
	c.Short = "E2B-compatible API and sandbox traffic proxy for OpenDsec"
	c.Args = cobra.NoArgs
	c.RunE = serveCmd.RunE
	c.SilenceUsage, c.SilenceErrors = true, true
	g.register(c)
	return c
}
