// cryptd from Go with net/http: sign (RFC 9421 hmac-sha256 and RFC 9530 Content-Digest),
// encrypt, decrypt, sign and verify, retrying on 429 / 503 as the server's Retry-After says.
// It first checks itself against the known-answer vector of docs/AUTH.md. Standard library
// only.
//
//	CRYPTD_CREDENTIAL=.cryptd-dev/client.json go run .
//	CRYPTD_URL=https://cryptd.example:8443 CRYPTD_CLIENT_ID=app CRYPTD_SECRET=<base64> \
//	  CRYPTD_CA_FILE=ca.crt go run .
//
// The credential file is client.json as `cryptd serve --dev` writes it ({url, client_id,
// secret, ca_file?}; a relative ca_file is taken from the file's directory); CRYPTD_URL,
// CRYPTD_CLIENT_ID, CRYPTD_SECRET and CRYPTD_CA_FILE override its fields. CRYPTD_CA_FILE is
// the PEM CA that issued the server's certificate (https:// with a private CA). Optional:
// CRYPTD_KEY (an encryption key, default aes256-gcm), CRYPTD_SIGNING_KEY (default
// ecdsa-p256). See README.md beside this file.
package main

import (
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Signer signs cryptd requests for one client.
type Signer struct {
	ClientID string
	Secret   []byte // the client secret's decoded bytes
}

const covered = `("@method" "@path" "@query" "content-digest" "content-type")`

// Headers returns Content-Type, Content-Digest, Signature-Input and Signature for a request.
// path is the path as sent (percent-encoded), query the query string without '?'.
func (s Signer) Headers(method, path, query string, body []byte, created int64, nonce string) map[string]string {
	sum := sha256.Sum256(body)
	digest := "sha-256=:" + base64.StdEncoding.EncodeToString(sum[:]) + ":"
	params := covered + ";created=" + strconv.FormatInt(created, 10) +
		`;nonce="` + nonce + `";keyid="` + s.ClientID + `";alg="hmac-sha256"`
	base := strings.Join([]string{
		`"@method": ` + method,
		`"@path": ` + path,
		`"@query": ?` + query,
		`"content-digest": ` + digest,
		`"content-type": application/json`,
		`"@signature-params": ` + params,
	}, "\n")
	mac := hmac.New(sha256.New, s.Secret)
	mac.Write([]byte(base))
	return map[string]string{
		"Content-Type":    "application/json",
		"Content-Digest":  digest,
		"Signature-Input": "sig1=" + params,
		"Signature":       "sig1=:" + base64.StdEncoding.EncodeToString(mac.Sum(nil)) + ":",
	}
}

// Client calls one cryptd.
type Client struct {
	BaseURL string
	Signer  Signer
	HTTP    *http.Client
}

// Retries of one call on 429 / 503 (rate limit, overload, a replay store's restart window):
// each retry is signed afresh (new created time and nonce); the wait is the server's
// Retry-After, refused above maxDelay, and all waits of one call stay within maxWait. Only
// the crypto operations of this example go through Call; never retry key management that
// changes state (create, rotate, PATCH, delete, import, restore): the API has no idempotency
// key.
const (
	maxAttempts = 4
	maxDelay    = 10 * time.Second
	maxWait     = 30 * time.Second
)

// Call sends a signed JSON request and decodes the JSON answer into out.
func (c Client) Call(method, target string, request, out any) error {
	body := []byte{}
	if request != nil {
		var err error
		if body, err = json.Marshal(request); err != nil {
			return err
		}
	}
	u, err := url.Parse(c.BaseURL + target)
	if err != nil {
		return err
	}
	var waited time.Duration
	for attempt := 1; ; attempt++ {
		status, retryAfter, answer, err := c.send(method, u, body)
		if err != nil {
			return err
		}
		if status/100 == 2 {
			return json.Unmarshal(answer, out)
		}
		if (status == 429 || status == 503) && attempt < maxAttempts &&
			retryAfter <= maxDelay && waited+retryAfter <= maxWait {
			fmt.Fprintf(os.Stderr, "%s %s answered %d: retrying in %s\n", method, target, status, retryAfter)
			time.Sleep(retryAfter)
			waited += retryAfter
			continue
		}
		return fmt.Errorf("%s %s: %d %s", method, target, status, answer)
	}
}

// send makes one signed attempt: the status, the Retry-After delay (1 s when absent or not
// a number of seconds) and the body.
func (c Client) send(method string, u *url.URL, body []byte) (int, time.Duration, []byte, error) {
	nonce := make([]byte, 16)
	if _, err := rand.Read(nonce); err != nil {
		return 0, 0, nil, err
	}
	req, err := http.NewRequest(method, u.String(), bytes.NewReader(body))
	if err != nil {
		return 0, 0, nil, err
	}
	headers := c.Signer.Headers(method, u.EscapedPath(), u.RawQuery, body, time.Now().Unix(), hex.EncodeToString(nonce))
	for name, value := range headers {
		req.Header.Set(name, value)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return 0, 0, nil, err
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, 0, nil, err
	}
	retryAfter := time.Second
	if seconds, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && seconds >= 0 {
		retryAfter = time.Duration(seconds) * time.Second
	}
	return resp.StatusCode, retryAfter, answer, nil
}

// credential is client.json as `cryptd serve --dev` writes it.
type credential struct {
	URL      string `json:"url"`
	ClientID string `json:"client_id"`
	Secret   string `json:"secret"`
	CAFile   string `json:"ca_file"`
}

// loadCredential reads CRYPTD_CREDENTIAL (when set); the CRYPTD_* variables override it.
func loadCredential() (credential, error) {
	var cred credential
	if path := os.Getenv("CRYPTD_CREDENTIAL"); path != "" {
		data, err := os.ReadFile(path)
		if err != nil {
			return cred, err
		}
		if err := json.Unmarshal(data, &cred); err != nil {
			return cred, fmt.Errorf("%s: %w", path, err)
		}
		if cred.CAFile != "" && !filepath.IsAbs(cred.CAFile) {
			cred.CAFile = filepath.Join(filepath.Dir(path), cred.CAFile)
		}
	}
	cred.URL = env("CRYPTD_URL", cred.URL)
	cred.ClientID = env("CRYPTD_CLIENT_ID", cred.ClientID)
	cred.Secret = env("CRYPTD_SECRET", cred.Secret)
	cred.CAFile = env("CRYPTD_CA_FILE", cred.CAFile)
	return cred, nil
}

// httpClient trusts caFile's certificates alone when given, else the system's.
func httpClient(caFile string) (*http.Client, error) {
	transport := http.DefaultTransport.(*http.Transport).Clone()
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, err
		}
		roots := x509.NewCertPool()
		if !roots.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%s: no PEM certificate", caFile)
		}
		transport.TLSClientConfig = &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
	}
	return &http.Client{Timeout: 10 * time.Second, Transport: transport}, nil
}

func selfTest() error {
	secret, _ := base64.StdEncoding.DecodeString("tKtlcrbpPWE/g55NZEzpcmn5vPIer40d8LoQ9x7BR14=")
	got := Signer{"billing", secret}.Headers("POST", "/v1/encrypt/orders", "",
		[]byte(`{"plaintext":"aGVsbG8gd29ybGQ="}`), 1767225600, "E7zF1Eme3Bi9KdgXtME_Mg")
	want := map[string]string{
		"Content-Digest":  "sha-256=:94eAsvH/2QofB45X76r4hBJjeSvuJl7rivOgGXAY5Lk=:",
		"Signature-Input": `sig1=("@method" "@path" "@query" "content-digest" "content-type");created=1767225600;nonce="E7zF1Eme3Bi9KdgXtME_Mg";keyid="billing";alg="hmac-sha256"`,
		"Signature":       "sig1=:stH31tVkXcP68lL6vDwKcynKuh5ojw2S9Fb43vySHfM=:",
	}
	for name, value := range want {
		if got[name] != value {
			return fmt.Errorf("known-answer vector: %s is %q, want %q", name, got[name], value)
		}
	}
	fmt.Println("known-answer vector: ok")
	return nil
}

// env is the variable's value, or fallback when it is unset or empty.
func env(name, fallback string) string {
	if value := os.Getenv(name); value != "" {
		return value
	}
	return fallback
}

func run() error {
	if err := selfTest(); err != nil {
		return err
	}
	cred, err := loadCredential()
	if err != nil {
		return err
	}
	for name, value := range map[string]string{"CRYPTD_URL": cred.URL, "CRYPTD_CLIENT_ID": cred.ClientID, "CRYPTD_SECRET": cred.Secret} {
		if value == "" {
			return fmt.Errorf("set CRYPTD_CREDENTIAL (a client.json) or %s", name)
		}
	}
	secret, err := base64.StdEncoding.DecodeString(cred.Secret)
	if err != nil {
		return fmt.Errorf("the secret is not base64: %w", err)
	}
	httpClient, err := httpClient(cred.CAFile)
	if err != nil {
		return err
	}
	client := Client{
		BaseURL: cred.URL,
		Signer:  Signer{cred.ClientID, secret},
		HTTP:    httpClient,
	}
	key := url.PathEscape(env("CRYPTD_KEY", "aes256-gcm"))
	signingKey := url.PathEscape(env("CRYPTD_SIGNING_KEY", "ecdsa-p256"))
	message := []byte("hello from Go and net/http")

	var encrypted struct {
		Ciphertext string `json:"ciphertext"`
		KeyVersion int    `json:"key_version"`
	}
	if err := client.Call("POST", "/v1/encrypt/"+key, map[string]any{"plaintext": message}, &encrypted); err != nil {
		return err
	}
	fmt.Println("encrypt:", encrypted.Ciphertext)
	var decrypted struct {
		Plaintext []byte `json:"plaintext"` // encoding/json: []byte is standard base64
	}
	if err := client.Call("POST", "/v1/decrypt/"+key, map[string]any{"ciphertext": encrypted.Ciphertext}, &decrypted); err != nil {
		return err
	}
	if !bytes.Equal(decrypted.Plaintext, message) {
		return fmt.Errorf("decrypt: got %q", decrypted.Plaintext)
	}
	fmt.Println("decrypt: ok")

	var signed struct {
		Signature []byte `json:"signature"`
	}
	if err := client.Call("POST", "/v1/sign/"+signingKey, map[string]any{"message": message}, &signed); err != nil {
		return err
	}
	fmt.Println("sign:", base64.StdEncoding.EncodeToString(signed.Signature))
	var verified struct {
		Valid bool `json:"valid"`
	}
	if err := client.Call("POST", "/v1/verify/"+signingKey, map[string]any{"message": message, "signature": signed.Signature}, &verified); err != nil {
		return err
	}
	if !verified.Valid {
		return fmt.Errorf("verify: not valid")
	}
	fmt.Println("verify: ok")

	// Post-quantum key exchange: X-Wing (ML-KEM-768 + X25519) gives a shared secret and the
	// ciphertext that carries it; the key's holder recovers the same secret from it.
	kemKey := url.PathEscape(env("CRYPTD_KEM_KEY", "x25519-ml-kem-768"))
	var encapsulated struct {
		Ciphertext   []byte `json:"ciphertext"`
		SharedSecret []byte `json:"shared_secret"`
	}
	if err := client.Call("POST", "/v1/encapsulate/"+kemKey, map[string]any{}, &encapsulated); err != nil {
		return err
	}
	var decapsulated struct {
		SharedSecret []byte `json:"shared_secret"`
	}
	if err := client.Call("POST", "/v1/decapsulate/"+kemKey, map[string]any{"ciphertext": encapsulated.Ciphertext}, &decapsulated); err != nil {
		return err
	}
	if len(encapsulated.SharedSecret) != 32 || !bytes.Equal(decapsulated.SharedSecret, encapsulated.SharedSecret) {
		return fmt.Errorf("kem: the shared secrets differ")
	}
	fmt.Printf("kem: ok (%d-byte ciphertext)\n", len(encapsulated.Ciphertext))
	return nil
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}
