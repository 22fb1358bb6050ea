// cryptd from Java 17 with java.net.http on its defaults: sign (RFC 9421 hmac-sha256 and
// RFC 9530 Content-Digest), encrypt, decrypt, sign and verify. It first checks itself against
// the known-answer vector of docs/AUTH.md. JDK only, no build tool:
//
//   CRYPTD_URL=http://127.0.0.1:8080 CRYPTD_CLIENT_ID=dev CRYPTD_SECRET=<base64> \
//     java CryptdExample.java
//
// Optional: CRYPTD_KEY (an encryption key, default aes256-gcm), CRYPTD_SIGNING_KEY (default
// ecdsa-p256). The JSON handling is deliberately minimal (the fields it reads are base64 and
// tokens); use your JSON library in real code.

import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.security.SecureRandom;
import java.util.Base64;
import java.util.HexFormat;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import javax.crypto.Mac;
import javax.crypto.spec.SecretKeySpec;

public final class CryptdExample {
    static final String COVERED =
        "(\"@method\" \"@path\" \"@query\" \"content-digest\" \"content-type\")";

    /** Signs cryptd requests for one client. */
    record Signer(String clientId, byte[] secret) {
        /** path as sent (percent-encoded), query without '?' ("" when none). */
        Map<String, String> headers(String method, String path, String query, byte[] body,
                                    long created, String nonce) throws Exception {
            Base64.Encoder b64 = Base64.getEncoder();
            String digest = "sha-256=:"
                + b64.encodeToString(MessageDigest.getInstance("SHA-256").digest(body)) + ":";
            String params = COVERED + ";created=" + created + ";nonce=\"" + nonce
                + "\";keyid=\"" + clientId + "\";alg=\"hmac-sha256\"";
            String base = String.join("\n",
                "\"@method\": " + method,
                "\"@path\": " + path,
                "\"@query\": ?" + query,
                "\"content-digest\": " + digest,
                "\"content-type\": application/json",
                "\"@signature-params\": " + params);
            Mac mac = Mac.getInstance("HmacSHA256");
            mac.init(new SecretKeySpec(secret, "HmacSHA256"));
            byte[] signature = mac.doFinal(base.getBytes(StandardCharsets.US_ASCII));
            Map<String, String> headers = new LinkedHashMap<>();
            headers.put("Content-Type", "application/json");
            headers.put("Content-Digest", digest);
            headers.put("Signature-Input", "sig1=" + params);
            headers.put("Signature", "sig1=:" + b64.encodeToString(signature) + ":");
            return headers;
        }
    }

    final HttpClient http = HttpClient.newHttpClient(); // defaults: HTTP/2 preferred
    final String baseUrl;
    final Signer signer;
    final SecureRandom random = new SecureRandom();

    CryptdExample(String baseUrl, Signer signer) {
        this.baseUrl = baseUrl;
        this.signer = signer;
    }

    /** A signed POST of a JSON body; returns the JSON answer, throws on a non-2xx status. */
    String post(String target, String json) throws Exception {
        byte[] body = json.getBytes(StandardCharsets.UTF_8);
        URI uri = URI.create(baseUrl + target);
        byte[] nonce = new byte[16];
        random.nextBytes(nonce);
        String query = uri.getRawQuery() == null ? "" : uri.getRawQuery();
        HttpRequest.Builder request = HttpRequest.newBuilder(uri)
            .POST(HttpRequest.BodyPublishers.ofByteArray(body));
        signer.headers("POST", uri.getRawPath(), query, body,
                System.currentTimeMillis() / 1000, HexFormat.of().formatHex(nonce))
            .forEach(request::header);
        HttpResponse<String> response =
            http.send(request.build(), HttpResponse.BodyHandlers.ofString());
        if (response.statusCode() / 100 != 2) {
            throw new IllegalStateException(
                "POST " + target + ": " + response.statusCode() + " " + response.body());
        }
        return response.body();
    }

    static String field(String json, String name) {
        Matcher m = Pattern.compile("\"" + name + "\":\\s*\"?([^\",}]*)\"?").matcher(json);
        if (!m.find()) {
            throw new IllegalStateException("no " + name + " in " + json);
        }
        return m.group(1);
    }

    static void selfTest() throws Exception {
        byte[] secret = Base64.getDecoder().decode("tKtlcrbpPWE/g55NZEzpcmn5vPIer40d8LoQ9x7BR14=");
        Map<String, String> got = new Signer("billing", secret).headers("POST",
            "/v1/encrypt/orders", "",
            "{\"plaintext\":\"aGVsbG8gd29ybGQ=\"}".getBytes(StandardCharsets.UTF_8),
            1767225600L, "E7zF1Eme3Bi9KdgXtME_Mg");
        Map<String, String> want = Map.of(
            "Content-Digest", "sha-256=:94eAsvH/2QofB45X76r4hBJjeSvuJl7rivOgGXAY5Lk=:",
            "Signature-Input", "sig1=" + COVERED
                + ";created=1767225600;nonce=\"E7zF1Eme3Bi9KdgXtME_Mg\";keyid=\"billing\""
                + ";alg=\"hmac-sha256\"",
            "Signature", "sig1=:stH31tVkXcP68lL6vDwKcynKuh5ojw2S9Fb43vySHfM=:");
        for (Map.Entry<String, String> entry : want.entrySet()) {
            if (!entry.getValue().equals(got.get(entry.getKey()))) {
                throw new IllegalStateException("known-answer vector: " + entry.getKey()
                    + " is " + got.get(entry.getKey()) + ", want " + entry.getValue());
            }
        }
        System.out.println("known-answer vector: ok");
    }

    static String env(String name, String fallback) {
        String value = System.getenv(name);
        if (value != null && !value.isEmpty()) {
            return value;
        }
        if (fallback == null) {
            throw new IllegalArgumentException("set " + name);
        }
        return fallback;
    }

    public static void main(String[] args) throws Exception {
        selfTest();
        byte[] secret = Base64.getDecoder().decode(env("CRYPTD_SECRET", null));
        CryptdExample cryptd = new CryptdExample(
            env("CRYPTD_URL", null), new Signer(env("CRYPTD_CLIENT_ID", null), secret));
        String key = env("CRYPTD_KEY", "aes256-gcm");
        String signingKey = env("CRYPTD_SIGNING_KEY", "ecdsa-p256");
        String message = "hello from Java and java.net.http";
        String plaintext = Base64.getEncoder()
            .encodeToString(message.getBytes(StandardCharsets.UTF_8));

        String token = field(cryptd.post("/v1/encrypt/" + key,
            "{\"plaintext\":\"" + plaintext + "\"}"), "ciphertext");
        System.out.println("encrypt: " + token);
        String decrypted = field(cryptd.post("/v1/decrypt/" + key,
            "{\"ciphertext\":\"" + token + "\"}"), "plaintext");
        if (!message.equals(new String(Base64.getDecoder().decode(decrypted),
                StandardCharsets.UTF_8))) {
            throw new IllegalStateException("decrypt: wrong plaintext");
        }
        System.out.println("decrypt: ok");

        String signature = field(cryptd.post("/v1/sign/" + signingKey,
            "{\"message\":\"" + plaintext + "\"}"), "signature");
        System.out.println("sign: " + signature);
        String valid = field(cryptd.post("/v1/verify/" + signingKey,
            "{\"message\":\"" + plaintext + "\",\"signature\":\"" + signature + "\"}"), "valid");
        if (!"true".equals(valid)) {
            throw new IllegalStateException("verify: not valid");
        }
        System.out.println("verify: ok");
    }
}
