package daemon

import (
	"fmt"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"

	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/log"
)

// DefaultDataDir is where state lives unless --data-dir says otherwise.
const DefaultDataDir = "/var/lib/opendsec"

type globalFlags struct {
	configPath string
	dataDir    string
}

func (g *globalFlags) register(c *cobra.Command) {
	c.PersistentFlags().StringVar(&g.configPath, "config", "", "config file (default "+config.DefaultPath+" if it exists)")
	c.PersistentFlags().StringVar(&g.dataDir, "data-dir", DefaultDataDir, "data directory")
}

func (g *globalFlags) load() (config.Config, error) {
	dd, err := filepath.Abs(g.dataDir)
	if err != nil {
		return config.Config{}, fmt.Errorf("data dir: %w", err)
	}
	cfg, err := config.Load(g.configPath, dd)
	if err != nil {
		return cfg, err
	}
	log.New(log.Options{Level: cfg.Log.Level, Format: cfg.Log.Format})
	return cfg, nil
}

// NewRootCommand returns the `opendsec` command tree.
func NewRootCommand() *cobra.Command {
	var g globalFlags
	root := &cobra.Command{
		Use:           "opendsec",
		Short:         "OpenDsec: self-hosted sandboxes for RL rollouts and code-running agents",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	g.register(root)
	root.AddCommand(upCommand(&g), tokenCommand(&g), imageCommand(&g), e2bCommand(&g), accelCommand(&g))
	for _, c := range []string{"node", "apiserver", "watcher"} {
		root.AddCommand(componentCommand(&g, c))
	}
	return root
}

// NewComponentCommand returns the command of a single-component binary.
func NewComponentCommand(name string) *cobra.Command {
	var g globalFlags
	c := componentCommand(&g, name)
	c.Use = "opendsec-" + name
	c.SilenceUsage, c.SilenceErrors = true, true
	g.register(c)
	return c
}

func upCommand(g *globalFlags) *cobra.Command {
	var o UpOptions
	c := &cobra.Command{
		Use:   "up",
		Short: "run the whole system for one machine in one process",
		Long: `up runs the node, watcher and apiserver in one process, each on its own
listener. On first start it creates a signing key and a bootstrap token in the
data dir. SIGTERM shuts down cleanly and leaves sandboxes running (the next
start recovers them) unless --stop-sandboxes is given.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := g.load()
			if err != nil {
				return err
			}
			if _, err := startPprof(cmd.Context(), cfg.Debug.PprofListen); err != nil {
				return err
			}
			return Up(cmd.Context(), cfg, o)
		},
	}
	c.Flags().BoolVar(&o.StopSandboxes, "stop-sandboxes", false, "stop every sandbox on shutdown")
	c.Flags().StringVar(&o.PidFile, "pid-file", "", "write the process ID here")
	c.Flags().StringVar(&o.ReadyFile, "ready-file", "", "write the API endpoint here once serving")
	return c
}

func componentCommand(g *globalFlags, name string) *cobra.Command {
	return &cobra.Command{
		Use:   name,
		Short: "run only the " + name + " component",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := g.load()
			if err != nil {
				return err
			}
			if _, err := startPprof(cmd.Context(), cfg.Debug.PprofListen); err != nil {
				return err
			}
			// Components hold the public key only; the watcher and
			// apiserver call others with a service token the operator
			// minted on the issuer (auth.service_token_file).
			pub, err := loadPublicKey(cfg)
			if err != nil {
				return err
			}
			if name == "node" {
				return RunNode(cmd.Context(), cfg, pub, nil)
			}
			tok, err := auth.NewFileToken(cfg.ServiceTokenPath())
			if err != nil {
				return err
			}
			if name == "watcher" {
				return RunWatcher(cmd.Context(), cfg, pub, tok, nil)
			}
			return RunAPIServer(cmd.Context(), cfg, pub, tok, nil)
		},
	}
}

func tokenCommand(g *globalFlags) *cobra.Command {
	c := &cobra.Command{Use: "token", Short: "manage API tokens"}
	var ttl time.Duration
	var scope, subject string
	create := &cobra.Command{
		Use:   "create",
		Short: "print a new signed token (needs the issuer's private key)",
		Long: `create mints a token with the issuer's ed25519 private key
(auth.private_key_file, by default <data-dir>/auth.ed25519, made by the first
` + "`opendsec up`" + `). Only the machine holding that key can mint; everywhere
else the public key only verifies.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := g.load()
			if err != nil {
				return err
			}
			if ttl <= 0 {
				return fmt.Errorf("--ttl: must be positive, e.g. 24h")
			}
			iss, err := auth.LoadIssuer(cfg.PrivateKeyPath())
			if err != nil {
				return fmt.Errorf("%w (run `opendsec up --data-dir %s` once to make the key pair, or run this where the issuer's key is)", err, cfg.DataDir)
			}
			tok, err := iss.Issue(subject, scope, ttl)
			if err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), tok)
			return nil
		},
	}
	create.Flags().DurationVar(&ttl, "ttl", 24*time.Hour, "lifetime")
	create.Flags().StringVar(&scope, "scope", auth.ScopeUser, "scope: user, admin or node")
	create.Flags().StringVar(&subject, "subject", "user", "principal the token names")
	c.AddCommand(create)
	return c
}
