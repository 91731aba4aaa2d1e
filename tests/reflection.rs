//! Server reflection lists the contract, so grpcurl and Postman work.

mod common;

use common::*;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

#[tokio::test]
async fn reflection_lists_the_agent_and_health_services() {
    let server = TestServer::tcp(Options::default()).await;
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", server.addr.unwrap()))
            .unwrap()
            .connect()
            .await
            .unwrap();
    let mut client = ServerReflectionClient::new(channel);
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = client
        .server_reflection_info(tokio_stream::once(req))
        .await
        .unwrap()
        .into_inner();
    let resp = responses.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = resp.message_response else {
        panic!("{resp:?}")
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"agents.v1.AgentService".to_string()),
        "{names:?}"
    );
    assert!(
        names.contains(&"grpc.health.v1.Health".to_string()),
        "{names:?}"
    );
    server.stop().await;
}
