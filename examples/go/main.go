// cryptd from Go with net/http: sign (RFC 9421 hmac-sha256 and RFC 9530 Content-Digest),
// encrypt, decrypt, sign and verify. It first checks itself against the known-answer vector
// of docs/AUTH.md. Standard library only.
//
//	CRYPTD_URL=http://127.0.0.1:8080 CRYPTD_CLIENT_ID=dev CRYPTD_SECRET=<base64> go run .
//
// Optional: CRYPTD_KEY (an encryption key, default aes256-gcm), CRYPTD_SIGNING_KEY (default
// ecdsa-p256).
package main

import (
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
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
	nonce := make([]byte, 16)
	if _, err := rand.Read(nonce); err != nil {
		return err
	}
	req, err := http.NewRequest(method, u.String(), bytes.NewReader(body))
	if err != nil {
		return err
	}
	headers := c.Signer.Headers(method, u.EscapedPath(), u.RawQuery, body, time.Now().Unix(), hex.EncodeToString(nonce))
	for name, value := range headers {
		req.Header.Set(name, value)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("%s %s: %d %s", method, target, resp.StatusCode, answer)
	}
	return json.Unmarshal(answer, out)
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

func env(name, fallback string) string {
	if value := os.Getenv(name); value != "" {
		return value
	}
	if fallback == "" {
		fmt.Fprintf(os.Stderr, "set %s\n", name)
		os.Exit(2)
	}
	return fallback
}

func run() error {
	if err := selfTest(); err != nil {
		return err
	}
	secret, err := base64.StdEncoding.DecodeString(env("CRYPTD_SECRET", ""))
	if err != nil {
		return fmt.Errorf("CRYPTD_SECRET is not base64: %w", err)
	}
	client := Client{
		BaseURL: env("CRYPTD_URL", ""),
		Signer:  Signer{env("CRYPTD_CLIENT_ID", ""), secret},
		HTTP:    &http.Client{Timeout: 10 * time.Second},
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
	return nil
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}
