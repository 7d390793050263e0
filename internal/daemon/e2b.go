package daemon

import (
	"context"
	"crypto/tls"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/e2b"
	"github.com/kernflux/opendsec/internal/httpserver"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/tlsca"
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
	procs := opendsecv1connect.NewProcessServiceClient(hc, strings.TrimRight(apiAddr, "/"),
		connect.WithInterceptors(auth.ClientInterceptorFrom(apiTok)))
	nodes, err := nodeDirectory(cfg)
	if err != nil {
		return err
	}
	gw, err := e2b.New(e2b.Config{
		API:                   api,
		Snapshots:             snaps,
		Images:                images,
		Trajectory:            procs,
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
		Backend:               cfg.E2B.Backend,
	})
	if err != nil {
		return fmt.Errorf("e2b gateway: %w", err)
	}
	if !cfg.E2B.TLS.Enabled {
		return serve(ctx, "e2b", cfg.E2B.Listen, gw, ready)
	}
	tlsCfg, ca, err := e2bTLSConfig(cfg, time.Now())
	if err != nil {
		return fmt.Errorf("e2b gateway: %w", err)
	}
	ln, err := httpserver.Listen(cfg.E2B.Listen)
	if err != nil {
		return fmt.Errorf("e2b: %w", err)
	}
	attrs := []any{"component", "e2b", "addr", ln.Addr().String(), "tls", true}
	if ca != "" {
		attrs = append(attrs, "ca_file", ca)
	}
	log.G(ctx).Info("listening", attrs...)
	if ready != nil {
		ready <- ln.Addr().String()
	}
	return httpserver.ServeTLS(ctx, "e2b", ln, gw, tlsCfg)
}

// e2bTLSConfig is the gateway's TLS configuration: the operator's
// certificate (e2b.tls.cert_file, key_file), or one from OpenDsec's CA made
// (or renewed) for the domain and e2b.tls.names, whose CA file it returns.
func e2bTLSConfig(cfg config.Config, now time.Time) (*tls.Config, string, error) {
	t := cfg.E2B.TLS
	certFile, keyFile, ca := t.CertFile, t.KeyFile, ""
	if certFile == "" {
		p, _, err := ensureE2BCA(cfg, now)
		if err != nil {
			return nil, "", err
		}
		certFile, keyFile, ca = p.Cert, p.Key, p.CA
	}
	kp, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, "", fmt.Errorf("e2b.tls: load %s and %s: %w", certFile, keyFile, err)
	}
	return &tls.Config{Certificates: []tls.Certificate{kp}, MinVersion: tls.VersionTLS12}, ca, nil
}

// ensureE2BCA makes (once) OpenDsec's CA and the gateway's certificate in
// the data dir, renewing the certificate when the names change.
func ensureE2BCA(cfg config.Config, now time.Time) (tlsca.Paths, bool, error) {
	return tlsca.Ensure(cfg.E2BTLSDir(), tlsca.Names(cfg.E2B.Domain, cfg.E2B.TLS.Names), now)
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
	var pemOut bool
	caCmd := &cobra.Command{
		Use:   "ca",
		Short: "print the path of the CA certificate clients trust for the gateway's TLS",
		Long: `ca prints the path of OpenDsec's CA certificate (PEM) that signs the E2B
gateway's certificate when e2b.tls is enabled without cert_file: point
SSL_CERT_FILE (Python SDK), NODE_EXTRA_CA_CERTS (JS SDK) or REQUESTS_CA_BUNDLE
at it. The CA and the certificate for the domain, *.<domain> and
e2b.tls.names are made if missing (the gateway does the same at start).
--pem prints the certificate itself.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := g.load()
			if err != nil {
				return err
			}
			if cfg.E2B.TLS.CertFile != "" {
				return fmt.Errorf("e2b.tls.cert_file is set: the gateway serves the operator's certificate, not one from OpenDsec's CA")
			}
			p, _, err := ensureE2BCA(cfg, time.Now())
			if err != nil {
				return err
			}
			if pemOut {
				b, err := os.ReadFile(p.CA)
				if err != nil {
					return err
				}
				_, err = cmd.OutOrStdout().Write(b)
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), p.CA)
			return nil
		},
	}
	caCmd.Flags().BoolVar(&pemOut, "pem", false, "print the CA certificate instead of its path")
	c.AddCommand(serveCmd, keys, caCmd)
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
